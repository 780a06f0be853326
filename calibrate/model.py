"""The X-Stage Burst-Gap model (xstage-paper, sections 3 and 4), as pure functions.

This module is the single source of truth for the model's equations; kernels,
simulators, fits and tests all call these functions instead of re-deriving them.

Units, everywhere unless a name says otherwise:
  * times in microseconds (``*_us``),
  * volumes in bytes,
  * the drain rate ``drain_rate`` in bytes per microsecond
    (use :func:`gbps_to_bytes_per_us`: 717 GB/s -> 717e3 bytes/us).

Every function accepts Python floats or numpy arrays (broadcast together) and
returns numpy scalars or arrays.  ``[x]+`` in the paper is :func:`positive_part`.

Symbols: V aggregate burst volume, G producer-side gap, R drain rate,
T_iss0 backpressure-free issue time, Q effective outstanding capacity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

MIB = 1024 * 1024


def gbps_to_bytes_per_us(rate_gbps):
    """Convert a rate in GB/s (1e9 bytes/s) to bytes per microsecond."""
    return np.asarray(rate_gbps, dtype=float) * 1e3


def bytes_per_us_to_gbps(rate_bytes_per_us):
    """Convert a rate in bytes per microsecond to GB/s (1e9 bytes/s)."""
    return np.asarray(rate_bytes_per_us, dtype=float) / 1e3


def positive_part(x):
    """[x]+ = max(x, 0)."""
    return np.maximum(x, 0.0)


# --- Section 3: the Burst-Gap model ------------------------------------------


def drain_time(volume_bytes, drain_rate):
    """Eq. 1: drain-dominated steady-state period V/R, in us."""
    return np.divide(volume_bytes, drain_rate, dtype=float)


def t_iss(gap_us, volume_bytes, t_iss0_us, drain_rate):
    """Eq. 3: sender-visible issue time T_iss(G) = max(T_iss0, V/R - G), in us."""
    return np.maximum(t_iss0_us, drain_time(volume_bytes, drain_rate) - gap_us)


def t_period(gap_us, volume_bytes, t_iss0_us, drain_rate):
    """Eq. 2 (max law): start-to-start period max(T_iss0 + G, V/R), in us.

    Equals T_iss(G) + G: the gap overlaps with post-issue draining.
    """
    return np.maximum(np.add(t_iss0_us, gap_us), drain_time(volume_bytes, drain_rate))


def t_period_completion_coupled(gap_us, volume_bytes, drain_rate):
    """Counterfactual period G + V/R if issue had to wait for remote completion, in us."""
    return np.add(gap_us, drain_time(volume_bytes, drain_rate))


def issue_overhead(gap_us, volume_bytes, t_iss0_us, drain_rate):
    """Eq. 4: backpressure overhead dT_iss = [V/R - G - T_iss0]+, in us."""
    return positive_part(drain_time(volume_bytes, drain_rate) - gap_us - t_iss0_us)


def recovery_gap(volume_bytes, t_iss0_us, drain_rate):
    """Eq. 5: minimum gap for backpressure-free issue, G* = [V/R - T_iss0]+, in us."""
    return positive_part(drain_time(volume_bytes, drain_rate) - t_iss0_us)


def q_peak(volume_bytes, t_iss0_us, drain_rate):
    """Eq. 6: peak outstanding volume of an isolated burst, [V - R*T_iss0]+, in bytes."""
    return positive_part(np.subtract(volume_bytes, np.multiply(drain_rate, t_iss0_us)))


def t_iss_isolated(volume_bytes, t_iss0_us, drain_rate, capacity_bytes):
    """Eq. 7: issue time of an isolated burst, max(T_iss0, (V - Q)/R), in us."""
    return np.maximum(t_iss0_us, drain_time(np.subtract(volume_bytes, capacity_bytes), drain_rate))


def capacity_overhead(volume_bytes, t_iss0_us, drain_rate, capacity_bytes):
    """Eq. 7's backpressure overhead of an isolated burst, T_iss^iso - T_iss0 = [(V - Q)/R - T_iss0]+, in us.

    Zero exactly when the capacity bound of eq. 10 holds ([V - R*T_iss0]+ <= Q); the capacity-bound
    counterpart of eq. 4's rate-bound overhead.
    """
    return positive_part(drain_time(np.subtract(volume_bytes, capacity_bytes), drain_rate) - t_iss0_us)


def capacity_from_knee(knee_volume_bytes, t_iss0_us, drain_rate):
    """Effective capacity Q from the isolated-burst knee: eq. 6 at the knee, in bytes.

    At the knee the burst just fills the capacity, so Q = V_knee - R*T_iss0.
    """
    return q_peak(knee_volume_bytes, t_iss0_us, drain_rate)


# --- Section 4.1: the design test (eq. 10) -----------------------------------


@dataclass(frozen=True)
class DesignVerdict:
    """Outcome of the two-bound design test (eq. 10) for one recurring burst, with what each bound costs.

    Rates are in bytes/us, volumes in bytes, times in us.  ``rate_ok`` and ``capacity_ok`` are eq. 10's two
    bounds, strictly.  A failing bound has a price per burst: the rate bound eq. 4's ``overhead``
    [V/R - G - T_iss0]+, the capacity bound eq. 7's ``capacity_overhead`` [(V - Q)/R - T_iss0]+ (issue time
    ``t_iss_isolated``).  ``decided_by`` names the bound with the larger price ("none" when both hold);
    ``cost_fraction`` is that price over the modeled period T_iss0 + price + G.  ``verdict`` is "piggyback"
    when both bounds hold or the price is at most ``tolerance`` of the period, else "reshape"; with
    tolerance 0 it is eq. 10 exactly.  ``reason`` says which bound failed, by how much and at what price.
    """

    rate_ok: bool
    capacity_ok: bool
    verdict: str
    reason: str
    volume: float
    gap: float
    t_iss0: float
    injection_rate: float
    drain_rate: float
    q_peak: float
    capacity: float
    recovery_gap: float
    overhead: float
    t_iss: float
    t_period: float
    t_iss_isolated: float
    capacity_overhead: float
    decided_by: str
    cost_fraction: float
    tolerance: float

    def to_dict(self) -> dict:
        return asdict(self)


def design_test(volume_bytes, gap_us, t_iss0_us, drain_rate, capacity_bytes, tolerance=0.0) -> DesignVerdict:
    """Eq. 10: rate bound V/(T_iss0 + G) <= R and capacity bound [V - R*T_iss0]+ <= Q, each priced.

    The rate bound's price is eq. 4, the capacity bound's eq. 7 (see :class:`DesignVerdict`); ``tolerance``
    (a fraction of the period, >= 0) is how much of the period a piggybacked burst may lose before the
    verdict is "reshape".  Scalars only: the verdict is one decision for one kernel burst.
    """
    volume, gap, t0 = float(volume_bytes), float(gap_us), float(t_iss0_us)
    rate, capacity, tolerance = float(drain_rate), float(capacity_bytes), float(tolerance)
    if t0 + gap <= 0.0:
        raise ValueError(f"T_iss0 + G must be > 0 us (got {t0 + gap:g})")
    if not tolerance >= 0.0:
        raise ValueError(f"tolerance must be >= 0 (a fraction of the period), got {tolerance:g}")
    injection_rate = volume / (t0 + gap)
    peak = float(q_peak(volume, t0, rate))
    g_star = float(recovery_gap(volume, t0, rate))
    rate_cost = float(issue_overhead(gap, volume, t0, rate))
    capacity_cost = float(capacity_overhead(volume, t0, rate, capacity))
    rate_ok = injection_rate <= rate
    capacity_ok = peak <= capacity

    failures = []
    if not rate_ok:
        failures.append(
            f"rate bound fails: injection {bytes_per_us_to_gbps(injection_rate):.0f} GB/s > "
            f"drain {bytes_per_us_to_gbps(rate):.0f} GB/s (gap {gap:.2f} us is "
            f"{g_star - gap:.2f} us short of G* = {g_star:.2f} us; eq. 4: +{rate_cost:.2f} us per burst)"
        )
    if not capacity_ok:
        failures.append(
            f"capacity bound fails: q_peak {peak / MIB:.3f} MiB > Q {capacity / MIB:.3f} MiB "
            f"by {(peak - capacity) / MIB:.3f} MiB (eq. 7: issue {t0 + capacity_cost:.2f} us instead of "
            f"T_iss0 = {t0:.2f} us, +{capacity_cost:.2f} us per burst)"
        )
    cost = max(rate_cost, capacity_cost)
    decided_by = "none" if not failures else ("rate" if rate_cost >= capacity_cost else "capacity")
    fraction = cost / (t0 + cost + gap)
    piggyback = not failures or fraction <= tolerance
    if failures:
        failures.append(f"the {decided_by} bound decides: +{cost:.2f} us = {100 * fraction:.2f}% of the "
                        f"{t0 + cost + gap:.2f} us period, {'within' if piggyback else 'over'} the tolerance "
                        f"{100 * tolerance:g}%")
    return DesignVerdict(
        rate_ok=bool(rate_ok),
        capacity_ok=bool(capacity_ok),
        verdict="piggyback" if piggyback else "reshape",
        reason="; ".join(failures) or "both bounds hold",
        volume=volume,
        gap=gap,
        t_iss0=t0,
        injection_rate=injection_rate,
        drain_rate=rate,
        q_peak=peak,
        capacity=capacity,
        recovery_gap=g_star,
        overhead=rate_cost,
        t_iss=float(t_iss(gap, volume, t0, rate)),
        t_period=float(t_period(gap, volume, t0, rate)),
        t_iss_isolated=float(t_iss_isolated(volume, t0, rate, capacity)),
        capacity_overhead=capacity_cost,
        decided_by=decided_by,
        cost_fraction=fraction,
        tolerance=tolerance,
    )


# --- Section 4.2: MegaMoE, reshaping by interleaving --------------------------


def interleaved_gap(t_mma_l2_us, t_mma_l1_us, n1_per_n2=1.0):
    """Eq. 12: gap with interleaving, G_int = T_mma_L2 + (n1/n2)*T_mma_L1, in us.

    The expert-wave gap is G_wave = T_mma_L2 (``n1_per_n2=0``).
    """
    return np.add(t_mma_l2_us, np.multiply(n1_per_n2, t_mma_l1_us))


def interleaved_overhead(wave_overhead_us, t_mma_l1_us, n1_per_n2=1.0):
    """Eq. 13: dT_iss_int = [dT_iss_wave - (n1/n2)*T_mma_L1]+, in us."""
    return positive_part(np.subtract(wave_overhead_us, np.multiply(n1_per_n2, t_mma_l1_us)))


def interleave_sufficient(volume_bytes, t_iss0_us, t_mma_l2_us, t_mma_l1_us, drain_rate, n1=1.0, n2=1.0):
    """Eq. 14: n2*V / (n2*T_iss0 + n2*T_mma_L2 + n1*T_mma_L1) <= R (boolean)."""
    cycle_us = np.multiply(n2, t_iss0_us) + np.multiply(n2, t_mma_l2_us) + np.multiply(n1, t_mma_l1_us)
    return np.multiply(n2, volume_bytes) / cycle_us <= drain_rate


def remote_store_span(t_iss0_us, overhead_us):
    """Predicted sender-visible remote-store span T_RS ~ T_iss0 + dT_iss, in us.

    Excludes the fixed staging overhead the paper mentions.
    """
    return np.add(t_iss0_us, overhead_us)


def critical_path_stall(t_rs_us, t_cover_us):
    """Eq. 15: per-tile compute stall [T_RS - T_cover]+, in us."""
    return positive_part(np.subtract(t_rs_us, t_cover_us))


def d_knee(b_n, k_sm, h_inter):
    """Eq. 16: anti-starvation lead D_knee = b_n*K_SM / (2*h_inter), in scheduler rows."""
    return np.multiply(b_n, k_sm) / np.multiply(2.0, h_inter)


# --- Section 4.3: FlashAttention-A2A, piggybacking on the Q-loop --------------


def fa_burst_bytes(b_m, d, s_out):
    """Per-producer output burst B_t = b_m*d*s_out, in bytes (s_out: bytes per element)."""
    return np.multiply(np.multiply(b_m, d), s_out)


def k_equiv(d):
    """Equivalent GEMM reduction dimension of one attention output tile: 2d."""
    return np.multiply(2, d)


def qloop_gap_lower_bound(seq_len, sigma_us, b_n):
    """Conservative Q-loop gap G_Qloop(M) >= sigma*M/b_n, in us (sigma: us per KV tile)."""
    return np.multiply(sigma_us, seq_len) / np.asarray(b_n, dtype=float)


def completion_coupled_stall(volume_bytes, drain_rate, t_lat_us, t_cover_us):
    """Eq. 17: exposed time per burst if issue waited for completion, [V/R + T_lat - T_cover]+, in us."""
    return positive_part(drain_time(volume_bytes, drain_rate) + t_lat_us - t_cover_us)


def completion_coupled_exposure(n_tiles, dt_cc_us):
    """Total completion-coupled exposure E_cc = N_t*dt_cc over N_t burst waves, in us."""
    return np.multiply(n_tiles, dt_cc_us)


def piggyback_stall(qloop_gap_us, volume_bytes, t_iss0_us, drain_rate):
    """Eq. 18: issue-side backpressure dt(M) = [V/R - G_Qloop(M) - T_iss0]+, in us."""
    return issue_overhead(qloop_gap_us, volume_bytes, t_iss0_us, drain_rate)


def critical_path_residual(stall_us, g_qk_us):
    """Eq. 19: stall reaching the compute critical path, dt'(M) = [dt(M) - G_QK]+, in us."""
    return positive_part(np.subtract(stall_us, g_qk_us))


def drain_residual(n_tiles, stall_us, g_qk_us):
    """Drain-induced residual over all burst waves, E_drain = N_t*[dt(M) - G_QK]+, in us."""
    return np.multiply(n_tiles, critical_path_residual(stall_us, g_qk_us))


def m_star_ub(volume_bytes, t_iss0_us, drain_rate, sigma_us, b_n):
    """Eq. 20: sequence length above which the rate bound surely holds, b_n*G*/sigma, in tokens."""
    return np.multiply(b_n, recovery_gap(volume_bytes, t_iss0_us, drain_rate)) / np.asarray(sigma_us, dtype=float)
