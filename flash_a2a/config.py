"""Per-shape choices of the attention kernels, resolved once into one frozen config.

The kernel has three measured defaults that depend on the shape: the split tail (the persistent walk's last,
partly empty round in KV chunks, in a second launch), the paced peer store, and the relay of a one-round rounds
kernel's peer tiles. ``resolve_config`` decides all three for one launch shape, from the fitted models below,
and returns an ``AttentionConfig`` that the API launches, the benchmark records and the tests read. An explicit
option (``tail_split=True/False``, ``store="st"/"paced"``, ``relay=True/False``) is kept where the kernel takes
it and refused with a ValueError naming the fix where it does not.
"""
from __future__ import annotations

from dataclasses import dataclass

from cute_kernels.tile_scheduler import local_tail
from flash_a2a.mapping import RELAY_START_KV, RELAY_THREADS
from flash_a2a.tiling import TILE_M, TILE_M_D64

OPTIONS = {"tail_split": ("auto", True, False), "store": ("auto", "st", "paced"), "relay": ("auto", True, False)}


def query_tile_rows(head_dim: int, instrument: bool = False) -> int:
    """Query rows per tile: TILE_M_D64 (192, three MMA warpgroups: FA4's SM90 configuration for d <= 64, where
    with two warpgroups the Tensor Cores idle under the softmax, whose exponentials per KV block take as long as
    its GEMMs at d = 64) at d = 64, local or fused, in any tile order (the Ulysses order cuts tiles from each
    rank's slice: the kernels' ranked walk where S/P is not a multiple of 192); TILE_M (128) at d = 128 and for
    the instrumented kernels (the spans dump has two warpgroup rows per tile)."""
    if head_dim == 64 and not instrument:
        return TILE_M_D64
    return TILE_M


@dataclass(frozen=True)
class AttentionConfig:
    """What one launch shape runs. ``grid`` CTAs (one per SM) walk ``n_tiles`` tiles of ``tile_m`` query rows
    (``query_tile_rows``) and ``n_kv`` KV blocks each, over ``world`` destination ranks (1: FA-only), with
    ``q_stages`` Q and ``kv_stages`` K/V pipeline stages (``local_stages``; 1 and 2 for the fused and split
    kernels).

    - ``tail_split``: the whole rounds in one launch (walk "rounds"), then the last round's tiles in ``split_k``
      KV chunks each in a second, programmatic dependent launch (walk "tail"); False: one launch (walk "all").
    - ``store``: how the kernel that stores to peers sends a tile: "st" (a burst after its Q-loop) or "paced"
      (one vector per thread every PACE_KV KV blocks of the next tile); always "st" for FA-only.
    - ``relay``: the rounds kernel's peer tiles go to local shadows, and the tail launch sends them on.
    """

    mode: str
    world: int
    n_tiles: int
    grid: int
    n_kv: int
    tail_split: bool
    split_k: int
    store: str
    relay: bool
    tile_m: int = TILE_M
    q_stages: int = 1
    kv_stages: int = 2

    def launches(self) -> tuple[dict, ...]:
        """The kernels of one call, in launch order, as FlashAttentionA2AForward keyword arguments beyond
        dtype, head_dim, mode, n_dst and instrument."""
        if not self.tail_split:
            shape = {name: value for name, value, default in (("tile_m", self.tile_m, TILE_M),
                                                              ("q_stages", self.q_stages, 1),
                                                              ("kv_stages", self.kv_stages, 2)) if value != default}
            return ({"walk": "all", "store": self.store, **shape},)
        return ({"walk": "rounds", "store": self.store}, {"walk": "tail", "relay": self.relay})


# The split tail's time per round of chunks, in tile-times: CHUNK_TIME_FACTOR / k + CHUNK_COST_KV_BLOCKS / n_kv.
# A chunk's KV blocks run slower than a whole tile's (the split kernel's KV loop is ptxas's 61-exponential
# schedule, and each chunk refills the K/V pipeline), and each chunk round pays a fixed part (the Q load, the
# fenced partial and count, the combining CTA's reads and the tile's store, the second launch). Fitted to the
# split-against-unsplit pairs of the full 2 x H200 run at 6c95827 (git show 43e424d:benchmarks/results/h200x2/
# flash_a2a_run_6c95827.json, column fa_ours_nosplit, six shapes with k = 2..11): 1.1 and 6 KV blocks (~9 µs at
# d = 128) put five of the six within 0.02 tile-times of the measurement (3 heads/8K 0.64 vs 0.65 measured,
# 3 heads/32K 1.03 vs 0.996, 48K 0.87 vs 0.85, 64K 0.76 vs 0.77, 12 heads/16K 0.83 vs 0.84; 12 heads/32K 0.36 vs 0.50).
CHUNK_TIME_FACTOR = 1.1
CHUNK_COST_KV_BLOCKS = 6.0
# What the second launch must at least save (the split tail), in KV-block times: the tail kernel's launch
# and prologue (2 x H200, 3 heads/8K: +2.4 µs against the one-launch split, fa_split_c46d572).
LAUNCH_COST_KV_BLOCKS = 2.0


def split_tail_time(tail: int, grid: int, n_kv: int, k: int) -> float:
    """The last round's time, in tile-times, with its ``tail`` tiles split into ``k`` KV chunks over ``grid``
    CTAs: ceil(tail·k / grid) rounds of chunks, each CHUNK_TIME_FACTOR / k of a tile plus
    CHUNK_COST_KV_BLOCKS; 1 for k = 1."""
    if k == 1:
        return 1.0
    return -(-tail * k // grid) * (CHUNK_TIME_FACTOR / k + CHUNK_COST_KV_BLOCKS / n_kv)


def choose_tail_split(n_tiles: int, grid: int, n_kv: int, max_k: int = 16) -> int:
    """The chunk count k for the last round's tiles: the one whose split tail takes the fewest tile-times
    (``split_tail_time``); 1 (no split) when the last round is full or no split beats the whole tiles."""
    tail = n_tiles % grid  # the whole walk when the tiles fit in one round
    if tail == 0:
        return 1
    best_k, best = 1, 1.0
    for k in range(2, min(max_k, n_kv) + 1):
        t = split_tail_time(tail, grid, n_kv, k)
        if t < best - 1e-9:
            best_k, best = k, t
    return best_k


def launch_split(n_tiles: int, grid: int, n_kv: int, world: int = 1):
    """What a split tail in a second launch would take: None when there is nothing to split (the tiles fit in
    one round, the last round is full, or no k > 1 shortens it, ``choose_tail_split``), else (tail tiles, k,
    whether the fused walk's local tail covers them: the tail launch stores locally and runs no ready gate;
    always at ``world`` = 1, the local kernel)."""
    tail = n_tiles % grid
    if n_tiles < grid or tail == 0:
        return None
    k = choose_tail_split(n_tiles, grid, n_kv)
    if k == 1:
        return None
    return tail, k, world == 1 or local_tail(n_tiles, world, grid) >= tail


def tail_launch_pays(n_tiles: int, grid: int, n_kv: int, world: int = 1) -> bool:
    """Where the split tail in a second launch (the split tail) is taken by "auto": ``launch_split`` has
    a split whose tail the fused walk keeps local, and it saves more than the second launch costs
    (``LAUNCH_COST_KV_BLOCKS``). Its rounds kernel keeps the default's KV loop, so only the chunks pay the
    split's slower schedule."""
    split = launch_split(n_tiles, grid, n_kv, world)
    if split is None or not split[2]:
        return False
    tail, k, _ = split
    return (1.0 - split_tail_time(tail, grid, n_kv, k)) * n_kv > LAUNCH_COST_KV_BLOCKS


# The fused epilogue's store (store="auto", the piggyback default): "paced" (a tile's stores leave one vector
# per thread every PACE_KV KV blocks of the next tile's Q-loop) or the burst ("st"). Pacing
# removes what NVLink adds to the burst's residual (fused minus its self-store control) but its Q-loop code costs
# the mainloop a fraction of its time: PACE_SLOWDOWN (self_paced2 minus self: 0.4-0.9% of T_FA). What it removes
# is about constant, PACE_SAVING_KV_BLOCKS (7-10 µs, ~4.6 KV-block times at d = 128, where it pays). So pacing pays
# in short kernels only: at most PACE_SAVING_KV_BLOCKS / PACE_SLOWDOWN = 767 KV-block rounds. Fitted to 2 x H200
# (benchmarks/results/h200x2/flash_a2a_variants/fused_paced_all_7c35388.json at 43e424d, 32 pairs, and
# fused_paced_split_53f1f5c.json): paced2 minus FA-only 3.2 / 5.1 µs against the burst's 10.9 / 11.6 at
# 3 heads/16K and 12 heads/8K (372 KV-block rounds each), 10.9 / 15.0 against 6.5 / 12.2 at 3 heads/32K and
# 12 heads/16K (1490), a tie at 3 heads/8K (one tile per CTA in the rounds kernel: nothing to pace under).
PACE_SLOWDOWN = 0.006
PACE_SAVING_KV_BLOCKS = 4.6


def paced_store_pays(n_tiles: int, grid: int, n_kv: int, split: bool = False) -> bool:
    """Whether store="auto" takes the paced epilogue for this walk: the kernel that stores to peers (with
    ``split`` the whole rounds only) gives each CTA a next tile to pace under (at least two
    tiles), and the Q-loop's slowdown over the whole kernel (PACE_SLOWDOWN of its n_tiles / grid · n_kv KV-block
    times) costs less than the burst's NVLink part it removes (PACE_SAVING_KV_BLOCKS)."""
    per_cta = n_tiles // grid if split else -(-n_tiles // grid)
    if per_cta < 2:
        return False
    return PACE_SLOWDOWN * (n_tiles / grid) * n_kv < PACE_SAVING_KV_BLOCKS


def relay_pays(n_tiles: int, grid: int, n_kv: int, world: int, split: bool) -> bool:
    """Where relay="auto" relays (the burst epilogue of a fused launch split): the rounds kernel is one round
    (every CTA has one tile, so its peer tiles go out together at its end with no next tile to pace under;
    at P = 2, 3 heads/8K, 96 tiles, 3 MiB, above Q(96) = 1.83 MiB) and the tail launch has chunks to drip them
    under. Where CTAs have a next tile, pacing (``paced_store_pays``) or the burst under it stays."""
    return world > 1 and split and n_tiles // grid == 1 and n_kv > RELAY_START_KV


# The Q double buffer (q_stages=2) of the one-launch local kernel: the next tile's Q loads under this tile's
# loop and the producer runs on into its K/V blocks, which removes a bubble at each tile boundary. At d = 128
# (one H200, benchmarks/results/h200/tile_sweep_60774af.json, medians of 8 rounds) it took 8192 x 16 heads to
# 512 keys (4 KV blocks per tile) from 67.1 to 61.4 µs and 4096 x 16 (32 blocks) from 191.2 to 189.8, but
# 8192 x 24 (64 blocks) from 1186.8 to 1197.6 and 32760 x 12 (256) from 9678.9 to 9704.9: double-buffered up to
# Q_DOUBLE_BUFFER_MAX_KV blocks. The 192-row d = 64 tiles (shared memory to spare) take it with a third K/V
# stage everywhere: fastest or tied at all five d = 64 rows of that run (32760 x 12: 6094.2 -> 6079.8 µs,
# 8192 x 16 to 512 keys 45.6 -> 43.7).
Q_DOUBLE_BUFFER_MAX_KV = 32


def local_stages(tile_m: int, n_kv: int) -> tuple[int, int]:
    """(Q stages, K/V stages) of the one-launch local kernel (``Q_DOUBLE_BUFFER_MAX_KV``)."""
    if tile_m == TILE_M_D64:
        return 2, 3
    return (2 if n_kv <= Q_DOUBLE_BUFFER_MAX_KV else 1), 2


def _option(name: str, value):
    if not any(value is v or (isinstance(v, str) and value == v) for v in OPTIONS[name]):
        raise ValueError(f"{name} must be one of {OPTIONS[name]}, got {value!r}")
    return value


def resolve_config(mode: str, n_tiles: int, grid: int, n_kv: int, world: int = 1, *, head_dim: int = 128,
                   instrument: bool = False, lse: bool = False, masked: bool = False, relay_vectors: int = 0,
                   tile_m: int = TILE_M,
                   tail_split="auto",
                   store="auto", relay="auto") -> AttentionConfig:
    """The launch plan of one shape: ``mode`` ("local" for FA-only, or a fused mode), its walk (``n_tiles``,
    ``grid``, ``n_kv``), ``world`` (the fused kernel's destination ranks; 1 for FA-only, whatever tile order it
    walks), ``relay_vectors`` (the relay's 16 B vectors: its indices are 32-bit), ``tile_m`` (the walk's query rows
    per tile, ``query_tile_rows``) and the three options.

    - tail_split "auto": the split where it pays (``tail_launch_pays``: a tail the fused walk keeps local, saving
      more than the second launch costs); True: wherever some k shortens the tail (ValueError where the tail is
      not all local); both fall back to one launch with nothing to split. The split kernel is built for
      head_dim 128 without instrumentation, the log-sum-exp (``lse``) or partial tiles (``masked``): "auto"
      does not split there, True is refused.
    - store "auto": "paced" for piggyback where ``paced_store_pays``, else "st"; "paced" needs piggyback and
      whole tiles (not ``masked``: the paced epilogue sends whole 64-row halves).
    - relay "auto": where ``relay_pays`` (piggyback, burst store, a one-round rounds kernel); True needs
      piggyback, world >= 2 and a split."""
    _option("tail_split", tail_split)
    _option("store", store)
    _option("relay", relay)
    fused = mode != "local"
    split_k = 1
    split = False
    if tail_split is not False:
        plan = launch_split(n_tiles, grid, n_kv, world)
        takes = head_dim == 128 and tile_m == TILE_M and not (instrument or lse or masked)
        if tail_split is True:
            if not takes:
                raise ValueError("tail_split=True: the split tail kernel is built for head_dim=128 without "
                                 "instrumentation (spans), the log-sum-exp (return_lse) or a length that is not a "
                                 "multiple of 128; pass tail_split=False or 'auto'")
            if plan is not None and not plan[2]:
                raise ValueError(f"tail_split=True: the last round of {plan[0]} tiles is not all local at world "
                                 f"size {world} (the tail launch stores locally); pass tail_split='auto'")
            split = plan is not None
        else:
            split = takes and tail_launch_pays(n_tiles, grid, n_kv, world)
        if split:
            split_k = plan[1]
    if store == "paced" and mode != "piggyback":
        raise ValueError(f"store='paced' spreads a tile's peer stores over the next tile's Q-loop: it needs "
                         f"mode='piggyback', got {mode!r}; pass store='st' or 'auto'")
    if store == "paced" and masked:
        raise ValueError(f"store='paced' sends whole tiles; with a length that is not a multiple of {tile_m} (a "
                         "partial tile) pass store='st' or 'auto'")
    if store == "auto":
        store = ("paced" if mode == "piggyback" and not masked and paced_store_pays(n_tiles, grid, n_kv, split)
                 else "st")
    fits = relay_vectors + RELAY_THREADS < 2 ** 31
    if relay is True:
        if mode != "piggyback" or world < 2 or not split:
            raise ValueError("relay=True sends the rounds kernel's peer tiles on from the split tail's launch: it "
                             "needs mode='piggyback', a world of 2 or more and a split tail (tail_split=True, or "
                             f"'auto' where the last round splits; this shape splits: {split}); pass relay='auto'")
        if not fits:
            raise ValueError(f"relay=True indexes its {relay_vectors} vectors with 32-bit integers: too many; "
                             "pass relay=False")
    elif relay == "auto":
        relay = (mode == "piggyback" and store == "st" and fits and relay_pays(n_tiles, grid, n_kv, world, split))
    q_stages, kv_stages = local_stages(tile_m, n_kv) if mode == "local" and not split else (1, 2)
    return AttentionConfig(mode=mode, world=world if fused else 1, n_tiles=n_tiles, grid=grid, n_kv=n_kv,
                           tail_split=split, split_k=split_k, store=store if fused else "st", relay=bool(relay),
                           tile_m=tile_m, q_stages=q_stages, kv_stages=kv_stages)
