"""Kernel burst descriptions, named presets, and the design test applied to a profile."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibrate import model
from calibrate.model import MIB
from calibrate.profile import PlatformProfile

# FlashAttention-4 output tile of the paper (sec. 4.3): b_m = b_n = 128, d = 128, bf16 output.
FA_TILE_M = FA_TILE_N = FA_HEAD_DIM = 128
BF16_BYTES = 2
FA_SEQ_LENS = (8192, 16384, 32768, 49152, 65536)

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


# Fallback for a profile without a measured sigma: the Q-loop time per KV tile implied by an attention
# throughput. 650 TFLOP/s is FA4's SM90 forward on our H200s (bf16, d = 128: 620-693 TFLOP/s, measured in
# shared/notes/hopper-fa-a2a.md); the FlashAttention benchmark replaces it with our own kernel's measurement.
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


def flash_a2a_burst(profile: PlatformProfile, seq_len: int, sigma_us: float) -> KernelBurst:
    """Fused FlashAttention + post-attention A2A output burst at sequence length M (sec. 4.3).

    The paper's conservative audit: every SM holds an output tile and all tile
    boundaries align, so K = sm_count (real persistent CTAs are phase-shifted and
    inject more smoothly).  The gap is the conservative Q-loop bound sigma*M/b_n.
    """
    producers = profile.sm_count
    b_t = float(model.fa_burst_bytes(FA_TILE_M, FA_HEAD_DIM, BF16_BYTES))
    volume = producers * b_t
    t_iss0 = float(profile.t_iss0(producers, volume))
    return KernelBurst(
        name=f"fa-a2a-m{seq_len}",
        producers=producers,
        bytes_per_producer=b_t,
        gap_us=float(model.qloop_gap_lower_bound(seq_len, sigma_us, FA_TILE_N)),
        description=(f"FlashAttention-4 + A2A, M={seq_len}: b_m=b_n={FA_TILE_M}, d={FA_HEAD_DIM}, bf16 out, "
                     f"K=sm_count aligned worst case, G=sigma*M/b_n with sigma={sigma_us:g} us/KV tile"),
        extra={
            "seq_len": seq_len,
            "sigma_us_per_kv_tile": sigma_us,
            "k_equiv": int(model.k_equiv(FA_HEAD_DIM)),
            "m_star_ub_tokens": float(model.m_star_ub(volume, t_iss0, profile.drain_rate, sigma_us, FA_TILE_N)),
        },
    )


def megamoe_burst(profile: PlatformProfile, model_name: str, n1_per_n2: float = 1.0) -> KernelBurst:
    """MegaMoE Linear-2 Combine burst under the expert-wave schedule (sec. 4.2).

    Assumes V_t = b_m*b_n*2 bytes (one 128x128 bf16 Combine tile per producer) and
    K_act = sm_count aligned producers; G_wave = T_mma_L2, and the interleaved gap
    (eq. 12) is reported alongside with n1/n2 = ``n1_per_n2``.
    """
    t_l2, t_l1 = MEGAMOE_MAINLOOPS_US[model_name]
    producers = profile.sm_count
    volume = producers * MEGAMOE_TILE_BYTES
    t_iss0 = float(profile.t_iss0(producers, volume))
    rate = profile.drain_rate
    wave_overhead = float(model.issue_overhead(t_l2, volume, t_iss0, rate))
    int_overhead = float(model.interleaved_overhead(wave_overhead, t_l1, n1_per_n2))
    gap_int = float(model.interleaved_gap(t_l2, t_l1, n1_per_n2))
    return KernelBurst(
        name=f"megamoe-{model_name}",
        producers=producers,
        bytes_per_producer=MEGAMOE_TILE_BYTES,
        gap_us=t_l2,
        description=(f"MegaMoE {model_name} expert-wave Linear-2 Combine: V_t = 128x128 bf16 tile, "
                     f"K_act=sm_count, G_wave=T_mma_L2={t_l2} us, T_mma_L1={t_l1} us (paper table 2), n1/n2={n1_per_n2:g}"),
        alt_gaps_us={"interleaved": gap_int},
        extra={
            "t_mma_l2_us": t_l2,
            "t_mma_l1_us": t_l1,
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


def presets(profile: PlatformProfile, sigma_us: float | None = None) -> dict[str, KernelBurst]:
    """All named presets for this profile; FA presets need a sigma (profile or override)."""
    found: dict[str, KernelBurst] = {}
    try:
        sigma = fa_sigma_us(profile, sigma_us)
    except ValueError:
        sigma = None
    if sigma is not None:
        for seq_len in FA_SEQ_LENS:
            burst = flash_a2a_burst(profile, seq_len, sigma)
            found[burst.name] = burst
    for name in MEGAMOE_MAINLOOPS_US:
        burst = megamoe_burst(profile, name)
        found[burst.name] = burst
    return found


def select_presets(profile: PlatformProfile, names: list[str], sigma_us: float | None = None) -> list[KernelBurst]:
    """Resolve preset names; "all" and family names ("fa-a2a", "megamoe") expand to several."""
    available = presets(profile, sigma_us)
    chosen: list[KernelBurst] = []
    for name in names:
        if name == "all":
            matches = list(available.values())
        else:
            matches = [b for key, b in available.items() if key == name or key.startswith(name + "-")]
        if not matches:
            if name.startswith("fa-a2a"):
                fa_sigma_us(profile, sigma_us)  # raises the missing-sigma message if that is the cause
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


def evaluate(profile: PlatformProfile, burst: KernelBurst) -> dict:
    """Run the design test (eq. 10) for one burst against the profile; returns all numbers."""
    validate_burst(profile, burst)
    volume = burst.volume_bytes
    t_iss0 = float(profile.t_iss0(burst.producers, volume))
    capacity = float(profile.capacity(burst.producers))
    verdict = model.design_test(volume, burst.gap_us, t_iss0, profile.drain_rate, capacity)
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


# --- figure -------------------------------------------------------------------------


def _plot_one(ax, profile: PlatformProfile, burst: KernelBurst, result: dict) -> None:
    volume, rate = burst.volume_bytes, profile.drain_rate
    t_iss0, g_star, drain_us = result["t_iss0"], result["recovery_gap"], result["drain_time_us"]
    g_max = 3.0 * g_star if g_star > 0 else 3.0 * max(t_iss0, drain_us)
    gaps = np.linspace(0.0, g_max, 400)

    ax.plot(gaps, model.t_period(gaps, volume, t_iss0, rate), color="tab:blue", lw=2, label="T_period(G) (max law)")
    ax.plot(gaps, model.t_period_completion_coupled(gaps, volume, rate), color="tab:blue", ls="--", lw=1.5,
            label="G + V/R (completion-coupled)")
    ax.plot(gaps, model.t_iss(gaps, volume, t_iss0, rate), color="tab:red", lw=2, label="T_iss(G)")
    ax.axhline(t_iss0, color="gray", ls=":", lw=1, label="T_iss0")
    ax.axhline(drain_us, color="black", ls=":", lw=1, label="V/R")
    if g_star > 0:
        ax.axvline(g_star, color="tab:green", ls="-.", lw=1.2, label="G*")

    notes = [f"V = {result['volume_MiB']:.2f} MiB, G* = {g_star:.2f} µs",
             f"q_peak = {result['q_peak_MiB']:.2f} {'≤' if result['capacity_ok'] else '>'} "
             f"Q = {result['capacity_MiB']:.2f} MiB",
             f"verdict: {result['verdict']}"]
    for label, gap in {"G": burst.gap_us, **burst.alt_gaps_us}.items():
        if gap <= g_max:
            ax.axvline(gap, color="tab:purple", lw=1.5, alpha=0.8)
            ax.annotate(label, (gap, 0.5), xycoords=("data", "axes fraction"), xytext=(3, 0),
                        textcoords="offset points", fontsize=8, color="tab:purple")
        notes.append(f"{label} = {gap:.2f} µs" + ("" if gap <= g_max else " (off axis →)"))
    ax.text(0.03, 0.96, "\n".join(notes), transform=ax.transAxes, ha="left", va="top", fontsize=8, zorder=5,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
    ax.set_xlim(0, g_max)
    # Head-room above the completion-coupled line keeps the notes box clear of the curves.
    ax.set_ylim(0, 1.6 * float(model.t_period_completion_coupled(g_max, volume, rate)))
    ax.set_xlabel("producer-side gap G (µs)")
    ax.set_ylabel("time (µs)")
    ax.set_title(f"{burst.name}: K={burst.producers}, B={burst.bytes_per_producer / 1024:g} KiB", fontsize=10)
    ax.grid(alpha=0.3)


def plot_design(profile: PlatformProfile, bursts: list[KernelBurst], path) -> Path:
    """Draw T_iss(G) and T_period(G) for each burst (one panel each) into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ncols = min(3, len(bursts))
    nrows = math.ceil(len(bursts) / ncols)
    legend_rows = 1 if ncols > 1 else 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.0, 5.2 * ncols), 3.9 * nrows + 1.0),
                             squeeze=False, layout="constrained")
    for ax, burst in zip(axes.flat, bursts):
        _plot_one(ax, profile, burst, evaluate(profile, burst))
    for ax in list(axes.flat)[len(bursts):]:
        ax.set_visible(False)

    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=math.ceil(len(labels) / legend_rows), fontsize=8,
               frameon=False)
    fig.suptitle(f"X-Stage design test — profile source: {profile.source}\n{profile.provenance['device']}",
                 fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
