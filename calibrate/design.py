"""Kernel burst descriptions, named presets, the design test applied to a profile, and its figure.

Presets (``presets``):
- ``fa-a2a-p{P}-h{H/P}-m{S}``: our fused FlashAttention + Ulysses post-attention All-to-All kernel as built.
  Its persistent grid walks the tiles destination rank fastest, so a round of ``grid`` concurrent tiles
  sends (P-1)/P of them to peers, and the walk ends on local tiles (the last round holds only local ones
  when it has at most n_tiles/P tiles, e.g. whenever n_tiles >= P x grid); the burst at a round boundary
  is those remote tiles (K = the CTAs that store remotely, 32 KiB each at d = 128), the gap a whole Q-loop.
- ``paper-fa-a2a-m{S}``: the paper's conservative audit (sec. 4.3): every SM's output tile boundary aligned,
  K = sm_count, whatever its destination.
- ``megamoe-{model}``: the paper's MegaMoE Linear-2 Combine bursts (sec. 4.2, table 2 mainloops).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibrate import model
from calibrate.model import MIB
from calibrate.profile import PlatformProfile

# FlashAttention output tile (the paper's FA4 and our kernel): b_m = b_n = 128, bf16 output.
FA_TILE_M = FA_TILE_N = 128
FA_HEAD_DIM = 128
BF16_BYTES = 2
# The shapes benchmarks/results/h200x2/flash_a2a.json measured: b = 1, d = 128, P = 2, 3 and 12 heads per rank.
FA_SEQ_LENS = (8192, 16384, 32768, 49152, 65536)
FA_HEADS_PER_RANK = (3, 12)
FA_WORLD = 2

# The verdict's default tolerance: the largest modeled backpressure cost per burst, as a fraction of the burst
# period, that still counts as piggyback. 2% is the project's hiding target (H >= 0.98, i.e. the fused kernel
# within 1.02x of FA-only), not a measured threshold; 0 is the paper's strict eq. 10.
DEFAULT_TOLERANCE = 0.02

# (T_mma_L2, T_mma_L1) tile mainloop times in us, W8A8 skewed routing, 55808 tokens, 8 GPUs:
# paper-numbers.json "table2_W8A8_skewed_55808_tokens_8gpu".
MEGAMOE_MAINLOOPS_US = {
    "dit-moe": (5.30, 9.77),
    "qwen3.5": (4.24, 14.40),
    "hy3": (6.09, 10.79),
    "mimo-v2.5": (7.77, 7.57),
    "glm-5.2": (7.99, 18.77),
    "dsv4-flash": (8.01, 7.40),
    "dsv4-pro": (9.54, 11.57),
}
# Combine output of one Linear-2 tile: b_m x b_n bf16 elements (128 x 128 x 2 bytes).
MEGAMOE_TILE_BYTES = 128 * 128 * BF16_BYTES
# Our MegaMoE kernel as built (megamoe.kernel, bf16, 147e2d5): full-tile mainloop medians (T_mma_L2, T_mma_L1)
# in us on one H200, the wave order at 8192 tokens per rank, balanced, P = 2 emulated
# (benchmarks/results/h200/megamoe_dump_P2_147e2d5_stall.json, in git at ba88fd4), and L1 tiles per L2 tile,
# n1 / n2 = 2I / H.
OURS_MEGAMOE = {
    "dsv4-flash": {"mainloops_us": (13.22, 27.04), "n1_per_n2": 2 * 2048 / 4096},
    "qwen3-moe": {"mainloops_us": (8.90, 24.70), "n1_per_n2": 2 * 1536 / 4096},
    "dit-moe": {"mainloops_us": (26.24, 5.76), "n1_per_n2": 2 * 4608 / 1152},
}
OURS_MEGAMOE_WORLDS = (2, 8)

# Units of the numbers ``evaluate`` returns (the CLI's --json prints this table beside the verdicts).
RESULT_UNITS = {
    "producers": "CTAs", "bytes_per_producer": "bytes", "volume": "bytes", "volume_MiB": "MiB",
    "gap": "us", "t_iss0": "us", "drain_time_us": "us (V/R, eq. 1)", "injection_rate": "bytes/us",
    "drain_rate": "bytes/us", "q_peak": "bytes (eq. 6)", "q_peak_MiB": "MiB (eq. 6)", "capacity": "bytes",
    "capacity_MiB": "MiB", "recovery_gap": "us (G*, eq. 5)", "overhead": "us per burst (eq. 4, rate bound)",
    "t_iss": "us (eq. 3)", "t_period": "us (eq. 2)", "t_iss_isolated": "us (eq. 7)",
    "capacity_overhead": "us per burst (eq. 7 - T_iss0, capacity bound)",
    "cost_fraction": "of the period T_iss0 + cost + G", "tolerance": "of the period",
}


@dataclass(frozen=True)
class KernelBurst:
    """A recurring remote-store burst: K producers each write B bytes, then compute for G us.

    ``alt_gaps_us`` holds other operating gaps worth showing (e.g. the interleaved
    schedule); ``extra`` holds application-specific numbers reported with the verdict.
    """

    name: str
    producers: int
    bytes_per_producer: float
    gap_us: float
    description: str = ""
    alt_gaps_us: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def volume_bytes(self) -> float:
        return float(self.producers * self.bytes_per_producer)

    @property
    def shape(self) -> tuple:
        """(producers, bytes per producer, gap): bursts with one shape have one design test and one panel."""
        return (int(self.producers), float(self.bytes_per_producer), round(float(self.gap_us), 9))


# --- FlashAttention-A2A -------------------------------------------------------------

# Fallback for a profile without a measured sigma: the Q-loop time per KV tile implied by an attention
# throughput. 650 TFLOP/s is FA4's SM90 forward on our H200s (bf16, d = 128: 620-693 TFLOP/s, measured in
# shared/notes/hopper-fa-a2a.md); a profile's applications.flash_a2a.sigma_us_per_kv_tile or --sigma-us
# replaces it with our own kernel's measurement.
FA_REFERENCE_TFLOPS = 650.0


def sigma_from_throughput(tflops: float, sm_count: int, b_m: int = FA_TILE_M, b_n: int = FA_TILE_N,
                          d: int = FA_HEAD_DIM) -> float:
    """µs per KV tile when sm_count persistent CTAs share ``tflops``: QK^T and PV are 4·b_m·b_n·d FLOP."""
    return 4.0 * b_m * b_n * d / (tflops * 1e12 / sm_count) * 1e6


def fa_sigma_us(profile: PlatformProfile, sigma_us: float | None = None) -> float:
    """Q-loop time per KV tile: the override, else the profile's flash_a2a entry, else the throughput fallback."""
    if sigma_us is not None:
        return float(sigma_us)
    try:
        return float(profile.applications["flash_a2a"]["sigma_us_per_kv_tile"])
    except (KeyError, TypeError):
        return sigma_from_throughput(FA_REFERENCE_TFLOPS, profile.sm_count)


def fused_walk_stretches(n_tiles: int, world: int, grid: int) -> tuple[int, int]:
    """(end1, end2) of the fused kernel's tile walk: its three stretches are tiles [0, end1), [end1, end2) and
    [end2, n_tiles).

    A group is one (row block of a rank's slice, head, batch) and holds one tile per destination rank.
    1. groups [0, G - k): destination rank fastest (tile t goes to rank t % P);
    2. groups [G - k, G): their P - 1 remote tiles;
    3. the same groups' local tiles, so the walk ends on k local tiles: k = min(G, tiles in the last round)
       (none at P = 1), since a remote burst in the last round has no compute left to drain under.
    This restates the kernel's walk (flash_a2a's Ulysses tile order; calibrate does not import flash_a2a):
    tests/test_design.py checks it tile by tile against the kernel's own walk and the measured spans.
    """
    groups = n_tiles // world
    last_round = n_tiles - (n_tiles - 1) // grid * grid
    k = min(groups, last_round) if world > 1 else 0
    return (groups - k) * world, n_tiles - k


def fused_tile_is_remote(n_tiles: int, world: int, grid: int, rank: int = 0) -> np.ndarray:
    """Per tile t of the walk (``fused_walk_stretches``): True when rank ``rank`` sends it to a peer."""
    end1, end2 = fused_walk_stretches(n_tiles, world, grid)
    t = np.arange(n_tiles)
    return np.where(t < end1, t % world != rank, t < end2)


def remote_tiles_per_round(n_tiles: int, world: int, grid: int, rank: int | None = None) -> list[int]:
    """Tiles sent to peers in each round of the persistent walk (CTA c takes tiles c, c + grid, ...: round r is
    tiles [r·grid, (r+1)·grid)), for ``rank``, or the most over all ranks (None: the busiest sender)."""
    ranks = range(world) if rank is None else (rank,)
    counts = np.zeros(-(-n_tiles // grid), dtype=int)
    for r in ranks:
        remote = fused_tile_is_remote(n_tiles, world, grid, r)
        counts = np.maximum(counts, np.add.reduceat(remote.astype(int), np.arange(0, n_tiles, grid)))
    return [int(c) for c in counts]


def _isolated_cost(profile: PlatformProfile, producers: int, bytes_per_producer: float) -> dict:
    """Eq. 6/7 for one round's burst of ``producers`` x ``bytes_per_producer``: its peak, Q and issue cost."""
    volume = producers * bytes_per_producer
    t0 = float(profile.t_iss0(producers, volume))
    capacity = float(profile.capacity(producers))
    rate = profile.drain_rate
    return {"producers": producers, "volume_MiB": volume / MIB,
            "q_peak_MiB": float(model.q_peak(volume, t0, rate)) / MIB, "capacity_MiB": capacity / MIB,
            "t_iss0_us": t0, "t_iss_isolated_us": float(model.t_iss_isolated(volume, t0, rate, capacity)),
            "capacity_overhead_us": float(model.capacity_overhead(volume, t0, rate, capacity))}


def flash_a2a_burst(profile: PlatformProfile, seq_len: int, heads_per_rank: int, sigma_us: float,
                    world: int = FA_WORLD, head_dim: int = FA_HEAD_DIM, batch: int = 1) -> KernelBurst:
    """Our fused FlashAttention + A2A kernel's round-boundary burst at (P, H/P, S), as built.

    Each rank walks n_tiles = b·(H/P)·S/128 output tiles of 128 x d bf16 (d = 128: 32 KiB, stored by the two
    MMA warpgroups as 2 x 16 KiB) over grid = min(n_tiles, sm_count) persistent CTAs. Every tile costs the same
    Q-loop, so the CTAs' tile boundaries stay aligned round after round: the burst at a round boundary is the
    round's remote tiles (``remote_tiles_per_round``), K = the CTAs that store remotely, B = one tile, and the
    gap is the next tile's whole Q-loop, S/128 KV blocks x sigma. The recurring burst is a round of the walk's
    first stretch, (P-1)/P of the grid; a walk with no such round (the tiles fit in about two rounds) has only
    its largest remote round. The last remote round (stretch 2: up to all of its tiles remote) is larger and
    happens once; its eq. 7 cost is reported in ``extra``, not tested for rate (its successor is the local tail).
    """
    if world < 1 or heads_per_rank < 1 or batch < 1:
        raise ValueError(f"world, heads_per_rank and batch must be >= 1, got {world}, {heads_per_rank}, {batch}")
    if seq_len <= 0 or seq_len % (world * FA_TILE_M):
        raise ValueError(f"sequence length {seq_len} must be a positive multiple of P x {FA_TILE_M} = "
                         f"{world * FA_TILE_M} (S/P rows per rank in whole {FA_TILE_M}-row tiles)")
    n_tiles = seq_len // FA_TILE_M * heads_per_rank * batch
    grid = min(n_tiles, profile.sm_count)
    counts = remote_tiles_per_round(n_tiles, world, grid)
    if not any(counts):
        raise ValueError(f"P = {world}: the walk sends no tile to a peer, there is no burst to test")
    end1, _ = fused_walk_stretches(n_tiles, world, grid)
    steady = [c for r, c in enumerate(counts) if (r + 1) * grid <= end1]
    producers = max(steady) if steady else max(counts)
    tile_bytes = float(model.fa_burst_bytes(FA_TILE_M, head_dim, BF16_BYTES))
    volume = producers * tile_bytes
    t_iss0 = float(profile.t_iss0(producers, volume))
    n_kv = seq_len // FA_TILE_N
    last = max(r for r, c in enumerate(counts) if c)
    wave = (f"a round sends {producers} of its {grid} tiles to peers ({len(steady)} such "
            f"round{'s' if len(steady) > 1 else ''})" if steady else
            f"its only recurring burst is its largest remote round, {producers} of {grid} tiles")
    return KernelBurst(
        name=f"fa-a2a-p{world}-h{heads_per_rank}-m{seq_len}",
        producers=producers,
        bytes_per_producer=tile_bytes,
        gap_us=float(model.qloop_gap_lower_bound(seq_len, sigma_us, FA_TILE_N)),
        description=(f"our fused FA + Ulysses A2A, P={world}, H/P={heads_per_rank}, S={seq_len}, d={head_dim}: "
                     f"{n_tiles} tiles over {grid} persistent CTAs in {len(counts)} rounds, destination rank "
                     f"fastest: {wave}; round {last} sends {counts[last]}, the last round sends {counts[-1]}; "
                     f"G = one Q-loop = {n_kv} KV blocks x sigma {sigma_us:g} us"),
        extra={
            "world": world,
            "heads_per_rank": heads_per_rank,
            "seq_len": seq_len,
            "head_dim": head_dim,
            "sigma_us_per_kv_tile": sigma_us,
            "n_tiles": n_tiles,
            "grid": grid,
            "remote_tiles_per_round": counts,
            "last_remote_round": {"round": last, **_isolated_cost(profile, counts[last], tile_bytes)},
            # Every remote round's eq. 7 cost, summed: what aligned boundaries would add to the kernel's issue.
            "capacity_overhead_all_rounds_us": sum(_isolated_cost(profile, c, tile_bytes)["capacity_overhead_us"]
                                                   for c in counts if c),
            "profile_world_size": profile.provenance.get("world_size"),
            "m_star_ub_tokens": float(model.m_star_ub(volume, t_iss0, profile.drain_rate, sigma_us, FA_TILE_N)),
        },
    )


def paper_flash_a2a_burst(profile: PlatformProfile, seq_len: int, sigma_us: float) -> KernelBurst:
    """The paper's FlashAttention-4 + A2A audit at sequence length M (sec. 4.3): every SM holds a 32 KiB output
    tile and all tile boundaries align, K = sm_count, whatever the tiles' destinations; G = sigma·M/b_n."""
    producers = profile.sm_count
    b_t = float(model.fa_burst_bytes(FA_TILE_M, FA_HEAD_DIM, BF16_BYTES))
    volume = producers * b_t
    t_iss0 = float(profile.t_iss0(producers, volume))
    return KernelBurst(
        name=f"paper-fa-a2a-m{seq_len}",
        producers=producers,
        bytes_per_producer=b_t,
        gap_us=float(model.qloop_gap_lower_bound(seq_len, sigma_us, FA_TILE_N)),
        description=(f"the paper's FA4 + A2A audit, M={seq_len}: b_m=b_n={FA_TILE_M}, d={FA_HEAD_DIM}, bf16 out, "
                     f"K=sm_count aligned worst case, G=sigma*M/b_n with sigma={sigma_us:g} us/KV tile"),
        extra={
            "seq_len": seq_len,
            "sigma_us_per_kv_tile": sigma_us,
            "k_equiv": int(model.k_equiv(FA_HEAD_DIM)),
            "m_star_ub_tokens": float(model.m_star_ub(volume, t_iss0, profile.drain_rate, sigma_us, FA_TILE_N)),
        },
    )


# --- MegaMoE ------------------------------------------------------------------------


def combine_burst(profile: PlatformProfile, name: str, t_l2: float, t_l1: float, bytes_per_producer: float,
                  n1_per_n2: float, description: str, extra: dict | None = None) -> KernelBurst:
    """A Linear-2 Combine burst under the expert-wave schedule (sec. 4.2): K_act = sm_count aligned producers of
    ``bytes_per_producer`` each, G_wave = T_mma_L2, and the interleaved gap (eq. 12, n1/n2 = ``n1_per_n2``),
    its overheads, eq. 14's test and eq. 15's stalls reported alongside."""
    producers = profile.sm_count
    volume = producers * bytes_per_producer
    t_iss0 = float(profile.t_iss0(producers, volume))
    rate = profile.drain_rate
    wave_overhead = float(model.issue_overhead(t_l2, volume, t_iss0, rate))
    int_overhead = float(model.interleaved_overhead(wave_overhead, t_l1, n1_per_n2))
    gap_int = float(model.interleaved_gap(t_l2, t_l1, n1_per_n2))
    return KernelBurst(
        name=name,
        producers=producers,
        bytes_per_producer=bytes_per_producer,
        gap_us=t_l2,
        description=description,
        alt_gaps_us={"interleaved": gap_int},
        extra={
            "t_mma_l2_us": t_l2,
            "t_mma_l1_us": t_l1,
            **(extra or {}),
            "interleaved_gap_us": gap_int,
            "wave_overhead_us": wave_overhead,
            "interleaved_overhead_us": int_overhead,
            "interleave_sufficient": bool(model.interleave_sufficient(
                volume, t_iss0, t_l2, t_l1, rate, n1=n1_per_n2, n2=1.0)),
            # T_cover is the next L2 mainloop (wave) or the inserted L1 mainloop (interleaved).
            "wave_stall_us": float(model.critical_path_stall(model.remote_store_span(t_iss0, wave_overhead), t_l2)),
            "interleaved_stall_us": float(model.critical_path_stall(model.remote_store_span(t_iss0, int_overhead), t_l1)),
        },
    )


def megamoe_burst(profile: PlatformProfile, model_name: str, n1_per_n2: float = 1.0) -> KernelBurst:
    """The paper's MegaMoE Linear-2 Combine burst (sec. 4.2, table 2 mainloops): V_t = b_m*b_n*2 bytes (one
    128x128 bf16 Combine tile per producer), every byte remote."""
    t_l2, t_l1 = MEGAMOE_MAINLOOPS_US[model_name]
    return combine_burst(
        profile, f"megamoe-{model_name}", t_l2, t_l1, MEGAMOE_TILE_BYTES, n1_per_n2,
        f"MegaMoE {model_name} expert-wave Linear-2 Combine: V_t = 128x128 bf16 tile, "
        f"K_act=sm_count, G_wave=T_mma_L2={t_l2} us, T_mma_L1={t_l1} us (paper table 2), n1/n2={n1_per_n2:g}")


def ours_megamoe_burst(profile: PlatformProfile, model_name: str, world: int) -> KernelBurst:
    """Our kernel's Linear-2 Combine burst at EP = ``world`` (sec. 4.2's test for megamoe.kernel as built): each
    L2 tile's epilogue stores its 128 x 128 bf16 rows (two 64-row warpgroup bursts) to their source ranks, of
    which (P-1)/P leave through NVLink on balanced routing (the rest land in local HBM, outside the X-stage);
    G_wave = the measured L2 mainloop, the interleaved gap from the L1 mainloop and the shape's L1 / L2 tile
    ratio."""
    if world < 2:
        raise ValueError(f"a Combine burst needs peers: world must be >= 2, got {world}")
    ours = OURS_MEGAMOE[model_name]
    t_l2, t_l1 = ours["mainloops_us"]
    ratio = ours["n1_per_n2"]
    bytes_per = MEGAMOE_TILE_BYTES * (world - 1) / world
    return combine_burst(
        profile, f"megamoe-ours-{model_name}-p{world}", t_l2, t_l1, bytes_per, ratio,
        f"our MegaMoE {model_name} at EP={world}: V_t = {bytes_per / 1024:.0f} KiB of each 32 KiB L2 tile remote, "
        f"K_act=sm_count, G_wave=T_mma_L2={t_l2} us, T_mma_L1={t_l1} us (measured, bf16, one H200), "
        f"n1/n2={ratio:g}", {"n1_per_n2": ratio})


# --- presets and the test -----------------------------------------------------------


def presets(profile: PlatformProfile, sigma_us: float | None = None, world: int = FA_WORLD,
            heads_per_rank=FA_HEADS_PER_RANK, seq_lens=FA_SEQ_LENS) -> dict[str, KernelBurst]:
    """All named presets for this profile: our kernel at P = ``world`` for every (heads per rank, sequence
    length), the paper's FA audit for every sequence length, and the paper's MegaMoE shapes."""
    sigma = fa_sigma_us(profile, sigma_us)
    found: dict[str, KernelBurst] = {}
    for h in heads_per_rank:
        for seq_len in seq_lens:
            burst = flash_a2a_burst(profile, seq_len, h, sigma, world)
            found[burst.name] = burst
    for seq_len in seq_lens:
        burst = paper_flash_a2a_burst(profile, seq_len, sigma)
        found[burst.name] = burst
    for name in MEGAMOE_MAINLOOPS_US:
        burst = megamoe_burst(profile, name)
        found[burst.name] = burst
    for name in OURS_MEGAMOE:
        for p in OURS_MEGAMOE_WORLDS:
            burst = ours_megamoe_burst(profile, name, p)
            found[burst.name] = burst
    return found


def select_presets(profile: PlatformProfile, names: list[str], sigma_us: float | None = None,
                   **shapes) -> list[KernelBurst]:
    """Resolve preset names; "all" and any name prefix ending at a dash ("fa-a2a", "fa-a2a-p2-h3",
    "paper-fa-a2a", "megamoe") expand to several. ``shapes``: ``presets``'s world, heads_per_rank, seq_lens."""
    available = presets(profile, sigma_us, **shapes)
    chosen: list[KernelBurst] = []
    for name in names:
        if name == "all":
            matches = list(available.values())
        else:
            matches = [b for key, b in available.items() if key == name or key.startswith(name + "-")]
        if not matches:
            raise ValueError(f"unknown preset '{name}' (see --list-presets)")
        chosen.extend(b for b in matches if b not in chosen)
    return chosen


def validate_burst(profile: PlatformProfile, burst: KernelBurst) -> None:
    if burst.producers <= 0:
        raise ValueError(f"{burst.name}: producers must be > 0, got {burst.producers}")
    if burst.producers > profile.sm_count:
        raise ValueError(f"{burst.name}: {burst.producers} producers exceed the profile's sm_count {profile.sm_count}")
    if burst.bytes_per_producer <= 0:
        raise ValueError(f"{burst.name}: bytes per producer must be > 0, got {burst.bytes_per_producer:g}")
    if burst.gap_us < 0:
        raise ValueError(f"{burst.name}: gap must be >= 0 us, got {burst.gap_us:g}")


def evaluate(profile: PlatformProfile, burst: KernelBurst, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Run the design test (eq. 10, each bound priced by eq. 4 and eq. 7) for one burst; returns all numbers
    (units: ``RESULT_UNITS``)."""
    validate_burst(profile, burst)
    volume = burst.volume_bytes
    t_iss0 = float(profile.t_iss0(burst.producers, volume))
    capacity = float(profile.capacity(burst.producers))
    verdict = model.design_test(volume, burst.gap_us, t_iss0, profile.drain_rate, capacity, tolerance)
    return {
        "name": burst.name,
        "description": burst.description,
        "producers": burst.producers,
        "bytes_per_producer": burst.bytes_per_producer,
        "volume_MiB": volume / MIB,
        "drain_time_us": float(model.drain_time(volume, profile.drain_rate)),
        "q_peak_MiB": verdict.q_peak / MIB,
        "capacity_MiB": capacity / MIB,
        **verdict.to_dict(),
        "alt_gaps_us": dict(burst.alt_gaps_us),
        **burst.extra,
    }


def burst_shapes(bursts: list[KernelBurst]) -> list[list[KernelBurst]]:
    """The bursts grouped by shape (producers, bytes, gap), in first-seen order: one group per panel."""
    groups: dict[tuple, list[KernelBurst]] = {}
    for burst in bursts:
        groups.setdefault(burst.shape, []).append(burst)
    return list(groups.values())


# --- figure -------------------------------------------------------------------------

FAIL_COLOR = "tab:red"


def _mark_failing_bounds(ax, result: dict) -> None:
    """Draw each failing bound of eq. 10 in red with its value, margin and price; say so when both hold.
    Every artist drawn here carries a gid "failing-bound:rate" / "failing-bound:capacity" / "bounds-hold"."""
    gap, g_star, t0 = result["gap"], result["recovery_gap"], result["t_iss0"]
    decides = result["decided_by"]
    lines = []
    if not result["rate_ok"]:
        gid = "failing-bound:rate"
        ax.axvspan(gap, g_star, color=FAIL_COLOR, alpha=0.15, lw=0, gid=gid, label="rate bound fails: G < G*")
        lines.append((gid, f"rate bound fails{' (decides)' if decides == 'rate' else ''}: "
                           f"G = {gap:.2f} < G* = {g_star:.2f} µs, {g_star - gap:.2f} µs short\n"
                           f"eq. 4: +{result['overhead']:.2f} µs per burst"))
    if not result["capacity_ok"]:
        gid = "failing-bound:capacity"
        t_iso = result["t_iss_isolated"]
        ax.axhspan(t0, t_iso, color=FAIL_COLOR, alpha=0.12, lw=0, gid=gid)
        ax.axhline(t_iso, color=FAIL_COLOR, lw=2.2, gid=gid, label="eq. 7 issue time (capacity bound fails)")
        excess = result["q_peak_MiB"] - result["capacity_MiB"]
        lines.append((gid, f"capacity bound fails{' (decides)' if decides == 'capacity' else ''}: "
                           f"q_peak {result['q_peak_MiB']:.2f} > Q({result['producers']}) = "
                           f"{result['capacity_MiB']:.2f} MiB by {excess:.2f} MiB\n"
                           f"eq. 7: issue {t_iso:.2f} µs, +{result['capacity_overhead']:.2f} µs per burst"))
    if not lines:
        lines.append(("bounds-hold", "both bounds hold (eq. 10)"))
    y = 0.68  # below the notes box, above the curves (the y limit leaves the top half free)
    for gid, text in lines:
        color = "tab:green" if gid == "bounds-hold" else FAIL_COLOR
        ax.text(0.03, y, text, transform=ax.transAxes, ha="left", va="top", fontsize=7.5, zorder=6,
                color=color, gid=gid, bbox={"boxstyle": "round", "fc": "white", "ec": color})
        y -= 0.03 + 0.045 * (text.count("\n") + 1)


def _plot_shape(ax, profile: PlatformProfile, bursts: list[KernelBurst], result: dict) -> None:
    """One panel: T_iss(G) and T_period(G) of one burst shape, shared by ``bursts`` (all have its shape)."""
    burst = bursts[0]
    volume, rate = burst.volume_bytes, profile.drain_rate
    t_iss0, g_star, drain_us = result["t_iss0"], result["recovery_gap"], result["drain_time_us"]
    t_iso = result["t_iss_isolated"]
    g_max = 3.0 * g_star if g_star > 0 else 3.0 * max(t_iss0, drain_us)
    gaps = np.linspace(0.0, g_max, 400)

    ax.plot(gaps, model.t_period(gaps, volume, t_iss0, rate), color="tab:blue", lw=2, label="T_period(G) (max law)")
    ax.plot(gaps, model.t_period_completion_coupled(gaps, volume, rate), color="tab:blue", ls="--", lw=1.5,
            label="G + V/R (completion-coupled)")
    ax.plot(gaps, model.t_iss(gaps, volume, t_iss0, rate), color="tab:orange", lw=2, label="T_iss(G), eq. 3")
    ax.axhline(t_iss0, color="gray", ls=":", lw=1, label="T_iss0")
    ax.axhline(drain_us, color="black", ls=":", lw=1, label="V/R")
    if g_star > 0:
        ax.axvline(g_star, color="tab:green", ls="-.", lw=1.2, label="G*")
    _mark_failing_bounds(ax, result)

    notes = [f"V = {result['volume_MiB']:.2f} MiB, V/R = {drain_us:.2f} µs, G* = {g_star:.2f} µs",
             f"q_peak = {result['q_peak_MiB']:.2f} {'≤' if result['capacity_ok'] else '>'} "
             f"Q = {result['capacity_MiB']:.2f} MiB"]
    gaps_shown: dict[str, float] = {"G": burst.gap_us}
    for member in bursts:
        gaps_shown.update(member.alt_gaps_us)
    for label, gap in gaps_shown.items():
        if gap <= g_max:
            ax.axvline(gap, color="tab:purple", lw=1.5, alpha=0.8)
            ax.annotate(label, (gap, 0.3), xycoords=("data", "axes fraction"), xytext=(3, 0),
                        textcoords="offset points", fontsize=8, color="tab:purple")
        notes.append(f"{label} = {gap:.2f} µs" + ("" if gap <= g_max else " (off axis →)"))
    notes.append(f"verdict: {result['verdict']} (cost {100 * result['cost_fraction']:.2f}% of the period, "
                 f"tolerance {100 * result['tolerance']:g}%)")
    ax.text(0.03, 0.96, "\n".join(notes), transform=ax.transAxes, ha="left", va="top", fontsize=7.5, zorder=5,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
    ax.set_xlim(0, g_max)
    # Head-room above the completion-coupled line keeps the notes clear of the curves.
    ax.set_ylim(0, 2.0 * max(float(model.t_period_completion_coupled(g_max, volume, rate)), t_iso))
    ax.set_xlabel("producer-side gap G (µs)")
    ax.set_ylabel("time (µs)")
    names = textwrap.fill(", ".join(b.name for b in bursts), width=70)
    ax.set_title(f"{names}\nK = {burst.producers}, B = {burst.bytes_per_producer / 1024:g} KiB", fontsize=8.5)
    ax.grid(alpha=0.3)


def design_figure(profile: PlatformProfile, bursts: list[KernelBurst], tolerance: float = DEFAULT_TOLERANCE):
    """The design-test figure: one panel per distinct burst shape (``burst_shapes``), its presets named in the
    title, the failing bounds marked. Returns the matplotlib Figure (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = burst_shapes(bursts)
    ncols = min(3, len(shapes))
    nrows = math.ceil(len(shapes) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.0, 5.6 * ncols), 4.3 * nrows + 1.2),
                             squeeze=False, layout="constrained")
    for ax, group in zip(axes.flat, shapes):
        _plot_shape(ax, profile, group, evaluate(profile, group[0], tolerance))
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)

    legend: dict[str, object] = {}
    for ax in axes.flat[:len(shapes)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    legend_rows = 1 if ncols > 2 else 3
    fig.legend(list(legend.values()), list(legend), loc="outside lower center",
               ncol=math.ceil(len(legend) / legend_rows), fontsize=8, frameon=False)
    fig.suptitle(f"X-Stage design test — profile source: {profile.source}, {profile.provenance['device']}; "
                 f"R = {profile.drain_rate_GBps:.0f} GB/s; failing bounds in red", fontsize=11)
    return fig


def plot_design(profile: PlatformProfile, bursts: list[KernelBurst], path,
                tolerance: float = DEFAULT_TOLERANCE) -> Path:
    """Write ``design_figure`` as a PNG at ``path`` (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = design_figure(profile, bursts, tolerance)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
